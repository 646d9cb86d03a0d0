"""A rank's first batch read imports nothing heavy: the trainer's first step costs what the later
ones cost, less only its own warm-up (docs/performance.md, "Where a step's time goes")."""

from __future__ import annotations

import json
import subprocess
import sys

from rollflow.infra.storage import RunStorage

from trainer_support import make_rows, write_batch

# In a fresh interpreter (this one imported everything already): the service's imports, then the
# first read of a committed batch, and the top-level packages that read imported.
READ = """
import json, sys, time
from rollflow.infra.storage import RunStorage
from rollflow.trainer.batches import BatchReader
import rollflow.trainer.rank_main  # the service's own imports
reader = BatchReader(RunStorage(sys.argv[1], "t"), 0, 1, micro_batch_tokens=64, row_tokens=None)
before = set(sys.modules)
reader.sequences(1, [0, 2], old_logprobs=False)
print(json.dumps(sorted({m.split(".")[0] for m in set(sys.modules) - before})))
"""


def test_the_first_batch_read_imports_no_new_package(tmp_path):
    write_batch(RunStorage(str(tmp_path), "t"), 1, make_rows(16, seed=3))
    out = subprocess.run(
        [sys.executable, "-c", READ, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    new = set(json.loads(out.stdout.strip().splitlines()[-1])) - {"pyarrow"}  # its own submodules
    assert not new, f"the first batch read imported {sorted(new)} inside the step"
