"""The Parquet schema of rollouts and training batches: the contract between stages.

One row is one completion. Rollouts (``rollouts/step=N``) leave ``advantage`` null; training
batches (``batches/step=N``) are the rows that survived the filters, with ``advantage`` set.
Per-environment extras travel as a JSON object in ``info`` (query it with DuckDB's ``->>``).
"""

from __future__ import annotations

import pyarrow as pa

ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("env", pa.string()),
        pa.field("prompt_id", pa.string()),
        pa.field("group_index", pa.int32()),
        pa.field("sample_index", pa.int32()),
        pa.field("prompt_text", pa.string()),
        pa.field("completion_text", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("completion_ids", pa.list_(pa.int32())),
        pa.field("completion_logprobs", pa.list_(pa.float32())),
        pa.field("reward", pa.float64()),
        pa.field("advantage", pa.float64()),
        pa.field("version_started", pa.int64()),
        pa.field("version_finished", pa.int64()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string()),
        pa.field("generate_s", pa.float64()),
        pa.field("reward_s", pa.float64()),
        pa.field("info", pa.string()),
    ]
)


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts with the schema's keys) to a table of exactly ``ROLLOUT_SCHEMA``."""
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
