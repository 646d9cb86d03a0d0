"""A rank's view of the run's committed batches: read, check, take this rank's share.

Owns: the cache of the step being trained (one step's tables at a time), the checks every row
passes before it trains (``check_row``: a bad row is ``InputError`` naming the step, row, group
and sample), this rank's share of a batch's micro-batches, and the trainer log-probs that
``forward`` writes (``logprobs/step=N``). Reads storage only: no collective, no model.
"""

from __future__ import annotations

import math

# pyarrow imports pandas on its first pa.array() (to tell pandas objects apart): imported with the
# service here, not inside the run's first forward_backward, where it took ~0.2 s of a 0.5 s call.
import pandas  # noqa: F401
import pyarrow as pa
import pyarrow.compute as pc

from rollflow.infra.errors import InputError
from rollflow.infra.storage import RunStorage
from rollflow.trainer.packing import PackedBatch, Sequence, pack, plan_micro_batches

BATCH_COLUMNS = [
    "env",
    "group_index",
    "sample_index",
    "prompt_ids",
    "completion_ids",
    "completion_logprobs",
    "advantage",
]
OPTIONAL_BATCH_COLUMNS = ["completion_mask"]  # absent in batches of older runs: all ones


class BatchReader:
    """The batches of one run, as rank ``rank`` of ``world_size`` trains them."""

    def __init__(
        self,
        storage: RunStorage,
        rank: int,
        world_size: int,
        *,
        micro_batch_tokens: int,
        row_tokens: int | None,
    ):
        self.storage, self.rank, self.world_size = storage, rank, world_size
        self.micro_batch_tokens, self.row_tokens = micro_batch_tokens, row_tokens
        self._cache: dict[tuple[str, int], pa.Table] = {}

    def _table(self, kind: str, step: int) -> pa.Table:
        key = (kind, step)
        if key not in self._cache:
            if not self.storage.is_committed(kind, step):
                hint = " (call forward first)" if kind == "logprobs" else ""
                raise InputError(f"{self.storage.step_uri(kind, step)} is not committed{hint}")
            self._cache = {k: v for k, v in self._cache.items() if k[1] == step}  # keep one step
            self._cache[key] = self.storage.read_step_table(kind, step)
        return self._cache[key]

    def sequences(
        self,
        step: int,
        groups: list[int] | None,
        old_logprobs: bool,
        samples: list[tuple[int, int]] | None = None,
    ) -> list[Sequence]:
        """The rows of batch ``step`` (restricted to ``groups``, then to the (group, sample) keys
        ``samples``), checked, in storage order."""
        table = self._table("batches", step)
        missing = [c for c in BATCH_COLUMNS if c not in table.column_names]
        if missing:
            raise InputError(f"batch step={step} lacks columns {missing}")
        if groups is not None:
            table = table.filter(
                pc.is_in(table["group_index"], value_set=pa.array(groups, type=pa.int32()))
            )
            absent = sorted(set(groups) - set(table["group_index"].to_pylist()))
            if absent:
                raise InputError(f"batch step={step} has no rows for groups {absent}")
        optional = [c for c in OPTIONAL_BATCH_COLUMNS if c in table.column_names]
        rows = table.select(BATCH_COLUMNS + optional).to_pylist()
        if samples is not None:
            wanted = {tuple(k) for k in samples}
            rows = [r for r in rows if (r["group_index"], r["sample_index"]) in wanted]
            if len(rows) != len(wanted):
                have = {(r["group_index"], r["sample_index"]) for r in rows}
                raise InputError(
                    f"batch step={step} has no rows for samples {sorted(wanted - have)[:8]}"
                )
        if not rows:
            raise InputError(f"batch step={step} has no rows for groups {groups}")
        old = self._old_logprobs(step) if old_logprobs else {}
        seqs = []
        for i, r in enumerate(rows):
            key = (r["group_index"], r["sample_index"])
            check_row(step, i, r, old.get(key) if old_logprobs else None, old_logprobs)
            seqs.append(
                Sequence(
                    list(r["prompt_ids"]),
                    list(r["completion_ids"]),
                    list(r["completion_logprobs"]),
                    float(r["advantage"]),
                    r["env"] or "",
                    key,
                    old.get(key),
                    _mask_or_none(r.get("completion_mask")),
                )
            )
        return seqs

    def _old_logprobs(self, step: int) -> dict[tuple[int, int], list[float]]:
        table = self._table("logprobs", step)
        return {
            (g, s): lp
            for g, s, lp in zip(
                table["group_index"].to_pylist(),
                table["sample_index"].to_pylist(),
                table["logprobs"].to_pylist(),
                strict=True,
            )
        }

    def my_micro_batches(self, seqs: list[Sequence]) -> list[PackedBatch]:
        """This rank's packed micro-batches of ``seqs`` (the same plan on every rank)."""
        plan = plan_micro_batches(
            [s.num_tokens for s in seqs], self.world_size, self.micro_batch_tokens
        )
        return [pack([seqs[i] for i in mb], self.row_tokens) for mb in plan[self.rank]]

    def write_logprobs(self, step: int, rows: list[tuple[tuple[int, int], list[float]]]) -> str:
        """Replace ``logprobs/step=N`` with ``rows`` ((group, sample) key, log-probs); its URI."""
        table = pa.table(
            {
                "group_index": pa.array([k[0] for k, _ in rows], pa.int32()),
                "sample_index": pa.array([k[1] for k, _ in rows], pa.int32()),
                "logprobs": pa.array([lp for _, lp in rows], pa.list_(pa.float32())),
            }
        )
        self.storage.remove_step("logprobs", step)
        self._cache.pop(("logprobs", step), None)
        return self.storage.write_step_table("logprobs", step, table)


def check_row(step: int, i: int, r: dict, old: list[float] | None, want_old: bool) -> None:
    """Row ``i`` of batch ``step`` can train (with trainer log-probs ``old`` when ``want_old``)."""
    where = f"batch step={step} row {i} (group {r['group_index']}, sample {r['sample_index']})"
    if not r["prompt_ids"]:
        raise InputError(
            f"{where}: empty prompt_ids; every sequence needs at least one prompt token"
        )
    if not r["completion_ids"]:
        raise InputError(f"{where}: empty completion_ids; filter such rows in the advantage stage")
    if len(r["completion_logprobs"] or []) != len(r["completion_ids"]):
        raise InputError(
            f"{where}: {len(r['completion_logprobs'] or [])} completion_logprobs for "
            f"{len(r['completion_ids'])} completion_ids"
        )
    mask = r.get("completion_mask")
    if mask is not None and (len(mask) != len(r["completion_ids"]) or set(mask) - {0, 1}):
        raise InputError(
            f"{where}: completion_mask must hold one 0 or 1 per completion token "
            f"({len(mask)} values for {len(r['completion_ids'])} tokens)"
        )
    if r["advantage"] is None or not math.isfinite(r["advantage"]):
        raise InputError(f"{where}: advantage is {r['advantage']}; it must be a finite number")
    if want_old and (old is None or len(old) != len(r["completion_ids"])):
        raise InputError(
            f"{where}: no trainer log-probs of matching length in logprobs/step={step}; "
            "call forward on this batch first"
        )


def _mask_or_none(mask: list[int] | None) -> list[int] | None:
    """None for an all-ones mask (the common single-turn row): nothing to mask."""
    if mask is None or all(mask):
        return None
    return list(mask)
