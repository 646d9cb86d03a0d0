"""The verifiers adapter: a verifiers 0.4 environment (``verifiers.v1``) played by rollflow's turns.

verifiers 0.4 splits an environment in two. A ``Taskset`` yields ``Task`` objects: the prompt
(``task.data.prompt``, a string or chat messages, and ``system_prompt``) and the scoring (the
task's ``@vf.reward`` functions, run by ``task.score(trace)``). An ``Env`` says how one task becomes
an episode: ``run(task, agents)`` opens ``agents.<seat>.interaction(task)`` and calls
``turn(message)`` for each environment turn (``turn()`` bare for the model's opening reply), or
``agents.<seat>.run(task)`` for one reply (``SingleAgentEnv``, what a plain taskset gets).

rollflow samples every model turn itself (token ids, log-probs, loss mask, retries, the
staleness bound), so the adapter hands ``run`` a seat whose turns are rollflow's: ``run`` plays on
the adapter's own event loop, and each ``turn(message)`` becomes the environment's reply of
``respond`` until rollflow's next model turn answers it. verifiers' harnesses, runtimes, model
clients and interception server are not used. Supported: verifiers 0.4.x (tested with 0.4.0);
0.2.x's API (``load_environment``, ``env_response``, a rubric) is gone from the package and from
here. Not supported: tool servers (``toolsets``), an env with two seats that play (user-sim), a
prompt-less task, runtime-dependent rewards (no runtime: verifiers skips them).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import random
import threading
from typing import Any

from pydantic import TypeAdapter

from rollflow.infra.errors import ConfigError, InputError
from rollflow.tasks.generate.ecosystems import require
from rollflow.tasks.generate.environments import Prompt, Split, in_eval_split, pick_indices
from rollflow.tasks.generate.multi_turn import EnvReply, MultiTurnEnv

_END = object()  # what an episode's run() says when it has returned


class VerifiersEnv(MultiTurnEnv):
    """A verifiers taskset's tasks and rewards, its env's turns, played by rollflow's model turns."""

    name = "verifiers"

    def __init__(
        self,
        taskset: str,
        taskset_args: dict[str, Any] | None = None,
        env: str = "",
        env_args: dict[str, Any] | None = None,
        max_turns: int = 8,
        max_total_tokens: int = 1024,
        num_tasks: int | None = None,
        eval_fraction: float = 0.1,
        eval_taskset_args: dict[str, Any] | None = None,
        turn_timeout_s: float = 600.0,
    ):
        super().__init__(max_turns, max_total_tokens)
        self.vf = require("verifiers.v1", "'verifiers>=0.4,<0.5'", "verifiers")
        self.taskset_id, self.turn_timeout_s = taskset, turn_timeout_s
        self.message = TypeAdapter(self.vf.Message)  # a chat message dict -> verifiers' type
        where = f"taskset {taskset!r}" + (f" with env {env!r}" if env else "")
        config = {**(env_args or {}), "taskset": {**(taskset_args or {}), "id": taskset}}
        try:
            self.vf_env = self.vf.load_environment(
                self.vf.resolve_env_config({**config, "id": env} if env else config)
            )
            train = self._tasks(self.vf_env.taskset, num_tasks)
            held = []
            if eval_taskset_args is not None:
                held_config = {**eval_taskset_args, "id": taskset}
                held = self._tasks(
                    self.vf.load_taskset(
                        self.vf.taskset_config_type(taskset).model_validate(held_config)
                    ),
                    num_tasks,
                )
        except Exception as exc:  # an unknown id, a misspelt key, a bad value: say which
            raise ConfigError(f"env verifiers: cannot load {where}: {exc}") from exc
        if held:  # the same prompt in both splits would leak the held-out set into training
            held_prompts = {t.data.prompt_text for t in held}
            train = [t for t in train if t.data.prompt_text not in held_prompts]
        else:  # no held-out taskset: a stable hash split by the tasks' own keys
            held = [t for t in train if in_eval_split(t.key, eval_fraction)]
            train = [t for t in train if not in_eval_split(t.key, eval_fraction)]
        if not train or not held:
            raise ConfigError(
                f"env verifiers: {where} gives {len(train)} training and {len(held)} held-out "
                "tasks; both need at least one (raise args.num_tasks, or set args.eval_taskset_args)"
            )
        self._tasks_of: dict[Split, list[Any]] = {"train": train, "eval": held}
        vf_taskset, task = self.vf_env.taskset, train[0]  # a taskset yields one Task type
        if type(vf_taskset).toolsets(vf_taskset.config) or type(task).toolsets(task.config):
            raise ConfigError(
                f"env verifiers: {where} has tool servers, which rollflow does not run; choose "
                "another taskset"
            )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()

    def _tasks(self, taskset: Any, num_tasks: int | None) -> list[Any]:
        if num_tasks is not None:
            taskset = taskset.take(num_tasks)
        elif not taskset.bounded:
            raise ConfigError("the taskset is infinite: set args.num_tasks")
        tasks = list(taskset)
        for task in tasks:
            if task.data.prompt is None:
                raise InputError(
                    f"task {task.data.idx} has no prompt (the user opens it); rollflow trains on "
                    "tasksets whose tasks have a prompt"
                )
        return tasks

    def _prompt(self, split: Split, i: int) -> Prompt:
        data = self._tasks_of[split][i].data
        messages = [{"role": "user", "content": data.prompt}]
        if not isinstance(data.prompt, str):
            messages = [m.model_dump(exclude_none=True) for m in data.prompt]
        if data.system_prompt:
            messages.insert(0, {"role": "system", "content": data.system_prompt})
        return Prompt(
            self.name,
            f"{self.taskset_id}:{split}:{i}",
            data.prompt_text,
            str(getattr(data, "answer", "")),
            tuple(messages),
        )

    def prompts(self, split: Split, count: int, rng: random.Random) -> list[Prompt]:
        n = len(self._tasks_of[split])
        return [self._prompt(split, i) for i in pick_indices(split, n, count, rng)]

    def start(self, prompt: Prompt) -> dict[str, Any]:
        _, split, index = prompt.prompt_id.rsplit(":", 2)
        task = self._tasks_of[split][int(index)]
        episode = _Episode(self, task, prompt.messages or (), self._event_loop())
        return {"episode": episode}

    def respond(self, prompt: Prompt, state: dict[str, Any], assistant_text: str) -> EnvReply:
        said = state["episode"].reply(assistant_text)
        return EnvReply(done=True) if not said else EnvReply(said)

    def last_turn(self, prompt: Prompt, state: dict[str, Any], assistant_text: str) -> None:
        state["episode"].last = assistant_text

    def score(self, prompt: Prompt, state: dict[str, Any]) -> float:
        return state["episode"].reward()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop every episode's ``run()`` plays on, a daemon thread's (made on first use)."""
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="verifiers", daemon=True
                ).start()
            return self._loop


class _Episode:
    """One task's ``Env.run``, on the adapter's loop, whose model turns rollflow samples.

    Owns the episode's verifiers ``Trace`` (the conversation as verifiers' rewards read it) and the
    hand-over of turns. Invariant: one side runs at a time: ``run()`` waits in ``turn`` for
    rollflow's next model reply, rollflow waits in ``reply`` for ``run()``'s next environment
    message or its end, and every wait ends within ``turn_timeout_s``. It stands in for
    verifiers' ``Interaction`` of the one seat that plays (``_Seat`` for its ``Agent``).
    """

    def __init__(self, adapter: VerifiersEnv, task: Any, messages: Any, loop: Any):
        self.vf, self.env, self.task, self.loop = adapter.vf, adapter.vf_env, task, loop
        self.timeout_s, self.max_turns = adapter.turn_timeout_s, adapter.max_turns
        self.where = f"env verifiers: taskset {adapter.taskset_id!r}, task {task.data.idx}"
        vf = self.vf
        self.trace = vf.Trace(
            task=vf.TraceTask(
                type=type(task).__name__, data=task.data, key=task.key, hash=task.hash
            ),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
        )
        self._message = adapter.message
        for message in messages:
            self._add(self._message.validate_python(message), sampled=False)
        self._replies: asyncio.Queue = asyncio.Queue()  # rollflow -> run(): text, None to end
        self._said: queue.Queue = queue.Queue()  # run() -> rollflow: messages, then _END
        self._run: Any = None  # run()'s concurrent future
        self._ended = self._over = False
        self.seat: str | None = None
        # The model's reply that used up max_total_tokens: run() gets it with the end of its turn.
        self.last: str | None = None

    # rollflow's side: worker threads

    def reply(self, text: str | None) -> list[dict[str, Any]] | None:
        """Hand ``run()`` the model's reply (None: rollflow ended the episode); the environment's
        next messages, or None once ``run()`` has returned."""
        if self._ended:
            return None
        if self._run is None:
            self._run = asyncio.run_coroutine_threadsafe(self._play(), self.loop)
        self.loop.call_soon_threadsafe(self._replies.put_nowait, text)
        try:
            said = self._said.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.where}: run() said nothing in {self.timeout_s} s") from None
        if said is _END:
            self._ended = True
            self._run.result()  # run()'s exception, if it raised
            return None
        return said

    def reward(self) -> float:
        """The trace's weighted reward once ``run()`` has returned (ended by rollflow if need be)."""
        self.reply(None)  # run() sees its turn terminated (a turn after that raises) and returns
        if not self.trace.ok:
            raise ValueError(f"{self.where}: run() returned without playing the task")
        return float(self.trace.reward)

    # verifiers' side: the adapter's loop

    async def _play(self) -> None:
        try:
            agents = self.vf.Agents(self.env.config, lambda name, _spec: _Seat(self, name))
            await self.env.setup(agents)
            await self.env.run(self.task, agents)
            if self.trace.ok:  # the seat's exchange closed, its rewards scored
                episode = self.vf.Episode(task=self.trace.task, traces=[self.trace], ok=True)
                await self.env.finalize(self.task, episode)
        finally:
            self._said.put(_END)

    def open(self, seat: _Seat, task: Any) -> _Episode:
        if self.seat not in (None, seat.name):
            raise ValueError(f"{self.where}: seats {self.seat!r} and {seat.name!r} both play")
        if not seat.trainable or task.data.prompt != self.task.data.prompt:
            raise ValueError(f"{self.where}: seat {seat.name!r} plays another prompt or untrained")
        self.seat = seat.name
        return self

    async def close(self, task: Any) -> None:
        """End the exchange as verifiers does: a stop condition, then the task's rewards."""
        if self.trace.stop_condition is None:
            self.trace.stop("user_closed")
        await task.score(self.trace)
        self.trace.is_completed = self.trace.ok = True

    async def turn(self, message: Any = None) -> Any:
        """``Interaction.turn``: send the environment's message, get the model's next reply."""
        vf = self.vf
        if self._over:
            raise RuntimeError(f"{self.where}: the exchange is over (rollflow ended it)")
        if message is None and self.trace.num_turns:
            raise ValueError(f"{self.where}: a bare turn() only takes the opening reply")
        if message is not None:
            messages = [vf.UserMessage(content=message)] if isinstance(message, str) else message
            messages = [self._message.validate_python(m) for m in messages]
            for m in messages:
                self._add(m, sampled=False)
            self._said.put([m.model_dump(exclude_none=True) for m in messages])
        try:
            text = await asyncio.wait_for(self._replies.get(), self.timeout_s)
        except TimeoutError:
            text = None  # rollflow left the episode: end it
            self.trace.record_timeout("agent")
        if text is None:  # rollflow ended the episode (at one of its limits, unless timed out)
            self._over = True
            ended_by_tokens = self.last is not None or self.trace.num_turns < self.max_turns
            final = []
            if self.last is not None:  # the reply that used up the tokens: scored, not answered
                final = [vf.AssistantMessage(content=self.last)]
                self._add(final[0], sampled=True)
            self.trace.stop("max_total_tokens" if ended_by_tokens else "max_turns")
            return vf.Segment(messages=final, terminated=True)
        reply = vf.AssistantMessage(content=text)
        self._add(reply, sampled=True)
        return vf.Segment(messages=[reply])

    def _add(self, message: Any, sampled: bool) -> None:
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(
            self.vf.MessageNode(parent=parent, message=message, sampled=sampled)
        )


class _Seat:
    """``agents.<name>`` in ``Env.run``: an agent whose turns are rollflow's."""

    def __init__(self, episode: _Episode, name: str):
        self.episode, self.name, self.trainable = episode, name, True

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_: Any):
        yield self.episode.open(self, task)
        await self.episode.close(task)

    async def run(self, task: Any, **_: Any) -> Any:
        async with self.interaction(task) as interaction:
            await interaction.turn()
            interaction.trace.stop("agent_completed")  # as verifiers' Agent.run ends
        return interaction.trace
