"""The run's Prefect flows. Every process that runs them shares one TLS context between its
Prefect clients (infra/prefect_tls.py: Prefect builds one per client, ~60 ms of CPU each here)."""

from rollflow.infra.prefect_tls import share_tls_context

share_tls_context()
