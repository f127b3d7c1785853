"""The package loader binding's signatures, read from this torch and from recorded docstrings of
other releases (loader.aoti), and the load_constants form chosen for each."""

from __future__ import annotations

import pytest

from loader import IncompatibleArtifactError
from loader.aoti import constants_call, describe, parse_signatures, signatures

# pybind11 docstrings as torch releases print them.
WITH_USER_MANAGED = (
    "load_constants(self: torch._C._aoti.AOTIModelPackageLoader, constants_map: dict[str, torch.Tensor], "
    "use_inactive: bool, check_full_update: bool, user_managed: bool = False) -> None\n"
)
THREE_UNNAMED = "load_constants(self: torch._C._aoti.AOTIModelPackageLoader, arg0: dict[str, torch.Tensor], arg1: bool, arg2: bool) -> None\n"
OVERLOADED = (
    "load_constants(*args, **kwargs)\nOverloaded function.\n\n"
    "1. load_constants(self: torch._C._aoti.AOTIModelPackageLoader, arg0: dict[str, torch.Tensor], arg1: bool, arg2: bool) -> None\n\n"
    "2. load_constants(self: torch._C._aoti.AOTIModelPackageLoader, constants_map: collections.abc.Mapping[str, torch.Tensor], "
    "use_inactive: bool, check_full_update: bool, user_managed: bool = False, allow_h2d_copy: bool = False) -> None\n"
)


def test_this_torch_takes_user_managed_and_the_weights_stay_in_place():
    (form,) = signatures()["load_constants"]
    assert form.names()[:4] == ("constants_map", "use_inactive", "check_full_update", "user_managed")
    call = constants_call(signatures()["load_constants"])
    assert call.args == (False, True, True) and call.in_place
    assert len(signatures()["__init__"][0].params) == 5  # path, model name, single-threaded, runners, device
    assert describe()["run"] == ["run(inputs, stream_handle=None)"]


def test_recorded_forms_of_other_releases():
    assert constants_call(tuple(parse_signatures("load_constants", WITH_USER_MANAGED))).in_place
    older = constants_call(tuple(parse_signatures("load_constants", THREE_UNNAMED)))
    assert older.args == (False, True) and not older.in_place  # the runner copies the weights
    both = parse_signatures("load_constants", OVERLOADED)
    assert [len(s.params) for s in both] == [3, 5]
    assert constants_call(tuple(both)).in_place


def test_a_form_the_loader_does_not_know_is_a_clear_error():
    unknown = tuple(
        parse_signatures("load_constants", "load_constants(self: X, constants: dict[str, torch.Tensor]) -> None")
    )
    with pytest.raises(
        IncompatibleArtifactError,
        match=r"load_constants has a form this loader does not know \(load_constants\(constants\)\)",
    ):
        constants_call(unknown)
    with pytest.raises(IncompatibleArtifactError, match="no documented signature"):
        constants_call(())


def test_defaults_and_nested_brackets_are_parsed():
    (sig,) = parse_signatures(
        "f", "f(self: X, a: dict[str, tuple[int, int]], b: bool = False, c: str = 'x, y') -> None"
    )
    assert sig.names() == ("a", "b", "c")
    assert [p.default for p in sig.params] == [None, "False", "'x, y'"]
