"""The private Prefect API's app: SQLite write transactions begin IMMEDIATE (no lock-upgrade 503s)."""

import asyncio

from prefect.server.database import provide_database_interface
from prefect.server.database.configurations import SQLITE_BEGIN_MODE, AioSqliteConfiguration

from rollflow.infra import prefect_server


def test_every_write_transaction_of_the_private_api_begins_immediate(monkeypatch):
    # Restored after the test: create_app patches Prefect's SQLite configuration in this process.
    monkeypatch.setattr(
        AioSqliteConfiguration, "begin_transaction", AioSqliteConfiguration.begin_transaction
    )
    db = provide_database_interface()
    assert isinstance(db.database_config, AioSqliteConfiguration)

    async def begin_mode() -> str | None:
        async with db.session_context(begin_transaction=True):
            return SQLITE_BEGIN_MODE.get()

    assert asyncio.run(begin_mode()) == "DEFERRED"  # Prefect's own choice for a plain write
    prefect_server.create_app()
    assert asyncio.run(begin_mode()) == "IMMEDIATE"
