"""An OpenEnv environment server for the tests, on openenv-core's server classes:
`python tests/openenv_server.py --port N --mode M` (uvicorn on 127.0.0.1).

Modes:
- lookup: the "lookup" game. reset(seed) draws a table of keys and words and one key from it;
  the observation's `prompt` shows the table and asks for the word for that key. The episode
  is one action: reward 1.0 if its `message` contains the key's word, else 0.0, and done.
  reset(padding=n) adds n characters to the prompt (an observation too large to show whole).
- colors: reset(seed, things) draws one of `things` (default: all of examples/agentic/lookup_tools.COLORS)
  and asks its color ("What color is the apple?"); one action: reward 1.0 if its `message` names
  the color, done.
  (The model can know it only from the lookup tool: tests/test_agentic.py's learning test.)
- slow: the lookup game whose steps sleep SLOW_S first (past any test's timeout_s).
- nonsense: no OpenEnv environment but a /ws route of its own, speaking the protocol wrong:
  it answers each step with the nonsense NONSENSE[answer] names, `answer` from the reset's
  data ({"answer": "reward"}: a reward that is not a number), and the reset with a plain
  observation, or with the nonsense too when the reset's data also says at="reset".
"""

import argparse
import random
import time

import uvicorn
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from pydantic import Field

from examples.agentic.lookup_tools import COLORS

KEYS = ("red", "blue", "green", "gold", "grey", "pink")
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle")
SLOW_S = 60.0
OK = '{"type":"observation","data":{"observation":{"prompt":"ok"},"reward":null,"done":false}}'
NONSENSE: dict[str, str | bytes] = {
    "text": "this is not JSON {",
    "list": "[1, 2, 3]",
    "error": '{"type":"error","data":{"message":"the environment broke","code":"EXECUTION_ERROR"}}',
    "shape": '{"type":"observation","data":{"observation":"not an object","done":false}}',
    "reward": '{"type":"observation","data":{"observation":{},"reward":"lots","done":true}}',
    "nan": '{"type":"observation","data":{"observation":{},"reward":NaN,"done":true}}',
    "done": '{"type":"observation","data":{"observation":{},"reward":1.0,"done":"maybe"}}',
    "binary": b"\x00\xff",
}


class LookupAction(Action):
    message: str = Field(..., max_length=100_000)


class LookupObservation(Observation):
    prompt: str = ""


class LookupEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own instance and nothing shared
    step_sleep_s = 0.0

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.word = ""

    def reset(self, seed=None, episode_id=None, padding: int = 0, **kwargs) -> LookupObservation:
        rng = random.Random(seed)
        table = dict(zip(KEYS, rng.sample(WORDS, len(KEYS))))
        key = rng.choice(KEYS)
        self.word = table[key]
        self._state = State(episode_id=episode_id, step_count=0)
        listed = ", ".join(f"{k}={w}" for k, w in table.items())
        return LookupObservation(prompt=f"Table: {listed}. What is the word for key {key}?" + "x" * padding)

    def step(self, action: LookupAction, timeout_s=None, **kwargs) -> LookupObservation:
        time.sleep(self.step_sleep_s)
        self._state.step_count += 1
        found = self.word in action.message.lower()
        return LookupObservation(prompt="right" if found else f"no: it was {self.word}",
                                 reward=1.0 if found else 0.0, done=True)

    @property
    def state(self) -> State:
        return self._state


class ColorsEnvironment(LookupEnvironment):
    def reset(self, seed=None, episode_id=None, things: list[str] | None = None, **kwargs) -> LookupObservation:
        thing = random.Random(seed).choice(sorted(things or COLORS))
        self.word = COLORS[thing]
        self._state = State(episode_id=episode_id, step_count=0)
        return LookupObservation(prompt=f"What color is the {thing}?")


class SlowEnvironment(LookupEnvironment):
    step_sleep_s = SLOW_S


def nonsense_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "healthy"}

    @app.websocket("/ws")
    async def ws(websocket: WebSocket):
        await websocket.accept()
        answer, at = "text", "step"
        try:
            while True:
                message = await websocket.receive_json()
                if message.get("type") == "reset":
                    answer, at = message["data"].get("answer", answer), message["data"].get("at", at)
                reply = NONSENSE[answer] if message.get("type") == at else OK
                await (websocket.send_bytes(reply) if isinstance(reply, bytes) else websocket.send_text(reply))
        except WebSocketDisconnect:
            pass

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=("lookup", "colors", "slow", "nonsense"), default="lookup")
    args = parser.parse_args()
    if args.mode == "nonsense":
        app = nonsense_app()
    else:
        env = {"lookup": LookupEnvironment, "colors": ColorsEnvironment, "slow": SlowEnvironment}[args.mode]
        app = create_fastapi_app(env, LookupAction, LookupObservation, max_concurrent_envs=256)
    # No lifespan wait at exit: the tests stop it with SIGTERM, sessions still open in slow mode.
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
