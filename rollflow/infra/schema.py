"""The Parquet schema of rollouts and training batches: the contract between stages.

One row is one completion. Rollouts (``rollouts/step=N``) leave ``advantage`` null; training
batches (``batches/step=N``) are the rows that survived the filters, with ``advantage`` set.
Per-environment extras travel as a JSON object in ``info`` (query it with DuckDB's ``->>``).

Multi-turn episodes are one row too: ``completion_ids`` is every token after the first prompt,
model turns and environment turns (tool results, a game's replies, the next turn's chat header)
in order, exactly as vLLM saw them. ``completion_mask`` says which tokens are the model's (1:
sampled, trained, with their sampling log-prob in ``completion_logprobs``) and which are the
environment's (0: context only, log-prob 0.0, never in a loss or a metric). ``turn_offsets[k]``
is where turn k starts in ``completion_ids``, ``turn_roles[k]`` is "assistant" for a model turn
or the environment's role ("tool", "user"), ``turn_versions[k]`` the policy version vLLM held
when that turn was requested (a weight sync can land between turns; staleness still counts from
``version_started``, the episode's first turn). Versions are steps, with a fraction where the
weights were sent mid-step: 3.75 is step 4's weights one of its four optimizer steps before its
end; rows written while versions were int64 read as whole numbers. ``num_turns`` counts model
turns; ``stop_reason`` is why the sample ended (single-turn: its ``finish_reason``, "stop" or
"length"; episodes: "env_done", "max_turns", "max_total_tokens"), and ``truncated`` marks one cut
before it finished ("length", "max_turns", "max_total_tokens"). Rows written before these
columns existed read them as null: all tokens trained, one turn.
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
        pa.field("version_started", pa.float64()),
        pa.field("version_finished", pa.float64()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string()),
        pa.field("generate_s", pa.float64()),
        pa.field("reward_s", pa.float64()),
        pa.field("info", pa.string()),
        pa.field("completion_mask", pa.list_(pa.int8())),
        pa.field("turn_offsets", pa.list_(pa.int32())),
        pa.field("turn_roles", pa.list_(pa.string())),
        pa.field("turn_versions", pa.list_(pa.float64())),
        pa.field("num_turns", pa.int32()),
        pa.field("stop_reason", pa.string()),
        pa.field("truncated", pa.bool_()),
    ]
)

# The multi-turn columns; a table without them (older runs) means: all tokens trained, one turn.
TURN_COLUMNS = (
    "completion_mask",
    "turn_offsets",
    "turn_roles",
    "turn_versions",
    "num_turns",
    "stop_reason",
    "truncated",
)


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts with the schema's keys) to a table of exactly ``ROLLOUT_SCHEMA``; a row without
    the multi-turn keys gets nulls there (read as: all tokens trained, one turn)."""
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def loss_mask(row: dict) -> list[int]:
    """The row's per-completion-token mask: its ``completion_mask``, or all ones when absent."""
    mask = row.get("completion_mask")
    return list(mask) if mask is not None else [1] * len(row["completion_ids"])
