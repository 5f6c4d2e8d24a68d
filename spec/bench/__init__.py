"""`python -m spec bench --questions FILE.jsonl`: a benchmark's question file (Spec-Bench, SPEED-Bench), run
prompt by prompt, plain greedy against speculative decoding, with every output checked token for token.

  questions  the question file read, checked line by line, and the subset asked for (--categories, --limit)
  table      per-question outcomes pooled by category: the table on stdout and bench.json
  local      in process: the questions through spec.experiment's steps (the pair `python -m spec` loads)
  served     over HTTP: a served engine under test against the same model served without speculation
  cli        the command line

Nothing here but `local` imports torch, so a served run needs only an HTTP client (as `spec conform` does).
"""
