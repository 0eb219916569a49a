"""Device steps and the code that drives them without an engine: the one jitted `extend`
(prefill, decode, verify) and the on-device decode loop (`steps`), chunked prefill,
sampling, batch descriptions (page tables, buckets) and `generate()`."""
