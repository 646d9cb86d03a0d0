"""The names of rollflow's Prefect flows and the entrypoints their deployments load.

Owns: every flow's name and entrypoint. The flows take their names from here, ``rollflow deploy``
(``deploy.py``) registers the entrypoints, the heal automations (``heal.py``) name the run flow:
a leaf, so that none of them imports another for a name.
"""

FLOW_NAME = "rl-run"  # the run flow's name (rl_run.py): deployments are rl-run/<config name>
# The deployments' flow (rl_run_deployment.py), named as Prefect loads it. Not imported here: `rollflow
# deploy` reads its parameter schema from the source, without importing torch (test_deploy checks it).
ENTRYPOINT = "rollflow/flows/rl_run_deployment.py:rl_run_config"
# The fleet's Prefect action (scale.py): `rollflow-scale/fleet`, registered beside any run's.
SCALE_FLOW_NAME = "rollflow-scale"
SCALE_ENTRYPOINT = "rollflow/flows/scale.py:scale_fleet"
# Machine loss (heal.py): `rollflow-heal/crashed-run`, which the heal automations run.
HEAL_FLOW_NAME = "rollflow-heal"
HEAL_ENTRYPOINT = "rollflow/flows/heal.py:heal_crashed_run"
# The trainer nodes of a run placed by Prefect, node 0 included (trainer_node.py): `rollflow-trainer-node/default`,
# submitted by the run flow (trainer.node_deployment).
NODE_FLOW_NAME = "rollflow-trainer-node"
NODE_ENTRYPOINT = "rollflow/flows/trainer_node.py:trainer_node"
# vLLM servers of a run placed by Prefect (inference_server.py): `rollflow-inference-server/default`,
# submitted by the run flow (inference.server_deployment).
SERVER_FLOW_NAME = "rollflow-inference-server"
SERVER_ENTRYPOINT = "rollflow/flows/inference_server.py:inference_server"
FLOWS = {  # entrypoint → flow name
    ENTRYPOINT: FLOW_NAME,
    SCALE_ENTRYPOINT: SCALE_FLOW_NAME,
    HEAL_ENTRYPOINT: HEAL_FLOW_NAME,
    NODE_ENTRYPOINT: NODE_FLOW_NAME,
    SERVER_ENTRYPOINT: SERVER_FLOW_NAME,
}
