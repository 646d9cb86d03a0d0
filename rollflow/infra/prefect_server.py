"""The app of the private Prefect API that ``rollflow run`` starts when none is configured.

It is Prefect's own server app with one change: on SQLite, every write transaction begins
``IMMEDIATE``. Prefect begins most of them ``DEFERRED``; a deferred transaction that reads and
then writes while another writer commits fails at once with "database is locked" (SQLite's
busy timeout does not apply to that upgrade), the API answers 503, and the client retries after
2 s, then 4 s, then 8 s. With a step's flow runs overlapping, that happened ~30 times in a
40-step tiny run and put 2–8 s stalls on the critical path (docs/performance.md). An immediate
transaction takes the write lock when it begins, so a second writer waits its turn (busy
timeout 60 s) instead of failing. Reads are unchanged (they begin no transaction).

A Prefect server the user runs (``PREFECT_API_URL``) is left as it is: for many concurrent runs
use PostgreSQL there, as Prefect recommends.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from prefect.server.api.server import create_app as prefect_create_app
from prefect.server.database.configurations import AioSqliteConfiguration

_deferred_begin = AioSqliteConfiguration.begin_transaction


@asynccontextmanager
async def _immediate_begin(self, session, with_for_update: bool = False):
    async with _deferred_begin(self, session, with_for_update=True) as transaction:
        yield transaction


def create_app():
    """Prefect's API app, its SQLite writers serialised (see the module docstring)."""
    AioSqliteConfiguration.begin_transaction = _immediate_begin
    return prefect_create_app()
