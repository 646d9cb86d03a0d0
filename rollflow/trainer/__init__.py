"""The trainer process: the code every rank of the trainer service runs.

The orchestrator reaches it only through its contract, ``protocol.py`` (the routes, their bodies
and replies, the ranks' entry point), with ``TrainerClient`` and the launcher
(``rollflow/services/trainer_process.py``). Keep this module free of imports: the run process
imports ``rollflow.trainer.protocol`` and must not load torch's distributed stack.
"""
