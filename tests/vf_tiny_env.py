"""A tiny verifiers 0.4 environment (``verifiers.v1``) for the verifiers adapter's tests: the
taskset id ``vf-tiny-env`` imports this module (verifiers finds a taskset's ``Taskset`` and ``Env``
in its ``__all__``).

Doubling questions, whose env asks once "Are you sure?" (an environment turn, so rollflow's loss
mask has a span to mask) and whose reward checks the last reply; a metric counts the turns.
"""

from __future__ import annotations

import verifiers.v1 as vf

SYSTEM = "Answer with the number only."
SURE = "Are you sure? Answer with the number only."


class TinyData(vf.TaskData):
    answer: str


class TinyTask(vf.Task[TinyData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task: TinyData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class TinyConfig(vf.TasksetConfig):
    size: int = 64


class TinyTaskset(vf.Taskset[TinyTask, TinyConfig]):
    def load(self):
        for i in range(self.config.size):
            data = TinyData(prompt=f"What is {i}+{i}?", system_prompt=SYSTEM, answer=str(2 * i))
            yield TinyTask(data, self.config.task)


class TinyEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TinyEnv(vf.Env[TinyEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated:
                await chat.turn(SURE)


__all__ = ["TinyEnv", "TinyTaskset"]
