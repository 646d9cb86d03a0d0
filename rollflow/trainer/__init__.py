"""The trainer process: the code every rank of the trainer service runs.

The orchestrator reaches it only through ``tasks/train`` (``TrainerClient``, the launcher) and
the contract both sides import, ``protocol.py``. Keep this module free of imports: the run
process imports ``rollflow.trainer.protocol`` and must not load torch's distributed stack.
"""

# The ranks' entry point (service.py), run by the launcher as a module. Named, not imported:
# importing it would load torch's distributed stack and DeepSpeed into the run process (~7 s).
SERVICE_MODULE = f"{__name__}.service"
