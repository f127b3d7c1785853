"""Writing and fixing profiles: ``init`` (a profile from example calls), ``doctor`` (every size a model
fixes or bounds, with its source line) and ``merge`` (recorded traffic folded into a profile)."""
