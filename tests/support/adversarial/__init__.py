"""The adversarial harness: random inputs at the edges of the definition, through every path, against reference.py.

- `menus`: per-field values at and around the contract's bounds (some invalid), and `row_spec`, one request;
- `cases`: random logits and token bitmasks, `Case` and `make_case` (a function of seed, path and index);
- `oracle`: `Oracle`, reference.py's definition for a whole batch at once (tests/test_adversarial_oracle.py
  checks it against `reference_sample_row` row by row; the rows of a full-row sampler and Mirostat's mu
  are reference.py's own, row by row);
- `compare`: two outputs row by row, to the logprob tolerance;
- `runner`: `Runner`, one case on one path (its sampler from tests/support/backends.py), every step checked;
- `findings`: `Tally`, `Finding`, `Log`;
- `campaign`: `run_campaign` (every path until its draws are made), `budgets`, `table`.

`benchmarks/adversarial.py` is the command over it; tests/test_adversarial.py runs a bounded campaign.
"""
