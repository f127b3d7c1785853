"""How many model kinds go from `precompile init` to a built artifact with no hand edit.

Twelve transformers architectures from tiny configs (encoders, decoders, encoder-decoders, vision,
audio): for each, `init` from two example calls, then `build` of the profile exactly as written
(dynamic-only plans, small ranges), then one call through the loader against eager. Writes
bench/results/init_survey.json and prints a table.

    .venv/bin/python -m bench.init_survey            # all, about 5 minutes on 2 cores
    .venv/bin/python -m bench.init_survey bert vit   # some
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

SMALL = dict(num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)


def _seeded_transformers():
    """transformers, with torch's seed reset: the artifact's weights and the reference's must be the
    same random ones."""
    import transformers

    torch.manual_seed(0)
    return transformers


def bert():
    T = _seeded_transformers()
    return T.BertModel(T.BertConfig(vocab_size=100, hidden_size=32, max_position_embeddings=64, **SMALL))


def roberta():
    T = _seeded_transformers()
    return T.RobertaModel(T.RobertaConfig(vocab_size=100, hidden_size=32, max_position_embeddings=66, **SMALL))


def distilbert():
    T = _seeded_transformers()
    return T.DistilBertModel(
        T.DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, hidden_dim=37, max_position_embeddings=64)
    )


def gpt2():
    T = _seeded_transformers()
    return T.GPT2LMHeadModel(
        T.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    )


def t5():
    T = _seeded_transformers()
    return T.T5Model(
        T.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=37, num_layers=1, num_heads=2, decoder_start_token_id=0)
    )


def bart():
    T = _seeded_transformers()
    return T.BartModel(
        T.BartConfig(
            vocab_size=100,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
        )
    )


def clip_text():
    T = _seeded_transformers()
    return T.CLIPTextModel(T.CLIPTextConfig(vocab_size=100, hidden_size=32, max_position_embeddings=32, **SMALL))


def vit():
    T = _seeded_transformers()
    return T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, **SMALL))


def swin():
    T = _seeded_transformers()
    return T.SwinModel(
        T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4)
    )


def resnet():
    T = _seeded_transformers()
    return T.ResNetModel(T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"))


def wav2vec2():
    T = _seeded_transformers()
    return T.Wav2Vec2Model(
        T.Wav2Vec2Config(
            hidden_size=32,
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            **SMALL,
        )
    )


def whisper_encoder():
    T = _seeded_transformers()
    config = T.WhisperConfig(
        vocab_size=100,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        num_mel_bins=16,
        max_source_positions=16,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        decoder_start_token_id=0,
    )
    return T.WhisperModel(config).get_encoder()


# name → (kind, two example calls)
CASES = {
    "bert": ("encoder", ["input_ids=2x8:int64 attention_mask=2x8:int64", "input_ids=3x12 attention_mask=3x12"]),
    "roberta": ("encoder", ["input_ids=2x8:int64 attention_mask=2x8:int64", "input_ids=3x12 attention_mask=3x12"]),
    "distilbert": ("encoder", ["input_ids=2x8:int64 attention_mask=2x8:int64", "input_ids=3x12 attention_mask=3x12"]),
    "gpt2": ("decoder", ["input_ids=2x8:int64", "input_ids=3x12"]),
    "clip_text": ("encoder (text tower)", ["input_ids=2x8:int64", "input_ids=3x12"]),
    "t5": (
        "encoder-decoder",
        ["input_ids=2x8:int64 decoder_input_ids=2x4:int64", "input_ids=3x12 decoder_input_ids=3x6"],
    ),
    "bart": (
        "encoder-decoder",
        ["input_ids=2x8:int64 decoder_input_ids=2x4:int64", "input_ids=3x12 decoder_input_ids=3x6"],
    ),
    "vit": ("vision", ["pixel_values=2x3x32x32", "pixel_values=3x3x32x32"]),
    "swin": ("vision", ["pixel_values=2x3x32x32", "pixel_values=3x3x32x32"]),
    "resnet": ("vision (conv)", ["pixel_values=2x3x32x32", "pixel_values=3x3x48x40"]),
    "wav2vec2": ("audio", ["input_values=2x400", "input_values=3x640"]),
    "whisper_encoder": ("audio", ["input_features=2x16x32", "input_features=3x16x32"]),
}


def run_case(name: str, folder: Path) -> dict:
    import loader
    from precompile.authoring.init import init_profile, parse_examples
    from precompile.pipeline import build
    from precompile.profile import load_profile
    from precompile.samples import make_inputs
    from precompile.stages.resolve import resolve_model

    kind, examples = CASES[name]
    row = {"model": name, "kind": kind, "stage": "init"}
    start = time.perf_counter()
    try:
        calls = parse_examples([e + " ;" for e in examples])
        path = folder / f"{name}.yaml"
        result = init_profile(f"survey_models:{name}", calls, output=path)
        path.write_text(result.text)
        row["notes"] = result.notes
        row["dims"] = {d.name: [d.min, d.max] for d in result.dims.values()}
        row["init_s"] = round(time.perf_counter() - start, 1)
        row["stage"] = "build"
        built = build(path, folder / f"{name}-artifact", jobs=1)
        row["stage"] = "call"
        loaded = load_profile(path)
        model, eager = loader.load(built.path), resolve_model(loaded)
        sizes = {d: spec.max for d, spec in loaded.profile.dims.items()}
        args = make_inputs(loaded.profile, sizes, seed=1)
        with torch.no_grad():
            want = eager(*args)
        got = model(*args)
        flat = lambda v: (
            [v]
            if isinstance(v, torch.Tensor)
            else [t for x in (v.values() if isinstance(v, dict) else v) for t in flat(x)]
        )
        for w, g in zip(flat(want), flat(got)):
            torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)
        row["stage"], row["ok"] = "done", True
    except Exception as e:  # the survey records every failure and goes on
        row["ok"] = False
        row["error"] = f"{type(e).__name__}: {e}"[:1500]
        row["traceback"] = traceback.format_exc()[-2000:]
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main(names: list[str]) -> None:
    names = names or list(CASES)
    rows = []
    with tempfile.TemporaryDirectory(prefix="init-survey-") as tmp:
        folder = Path(tmp)
        shutil.copy(__file__, folder / "survey_models.py")
        for name in names:
            row = run_case(name, folder)
            rows.append(row)
            status = "ok" if row["ok"] else f"FAILED at {row['stage']}: {row['error'].splitlines()[0][:160]}"
            print(f"{name:<16} {row['kind']:<22} {row['seconds']:6.1f} s  {row.get('dims', {})}  {status}", flush=True)
    ok = sum(r["ok"] for r in rows)
    print(
        f"\n{ok} of {len(rows)} model kinds went from `precompile init` to a built, matching artifact with no hand edit"
    )
    out = Path(__file__).parent / "results" / "init_survey.json"
    out.write_text(json.dumps({"torch": torch.__version__, "ok": ok, "total": len(rows), "rows": rows}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
