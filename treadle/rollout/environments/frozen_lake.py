"""The ``frozen_lake`` environment: gymnasium's FrozenLake as a text game. The policy sees the
map as a grid (``A`` where it stands, ``H`` holes, ``G`` the goal, ``F`` frozen ice) and moves
with ``<answer>left|down|right|up</answer>``; after each move it is shown the new grid. The
episode ends at the goal (reward 1) or in a hole (reward 0); out of turns it is 0 too.

Each task gets its own random map (gymnasium's ``generate_random_map``, seeded by the task id,
so a group's episodes walk the same lake). Synchronous, run in treadle's thread pool, as any gym
environment would be. The expert (for SFT demonstrations) walks a shortest safe path.
"""

from __future__ import annotations

import hashlib
import re
from collections import deque

from treadle.core.types import Task
from treadle.rollout.environments.base import StepResult
from treadle.rollout.environments.tool_calls import AssistantTurn

ACTIONS = ("left", "down", "right", "up")
"""gymnasium's FrozenLake actions, by index."""
_MOVES = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}
_WORD = re.compile(r"\b(left|down|right|up)\b", re.IGNORECASE)
_ANSWER = re.compile(r"<answer>\s*(left|down|right|up)\s*</answer>", re.IGNORECASE)


def read_action(text: str) -> int | None:
    """The move in a reply: its last ``<answer>move</answer>``, else its last move word; None
    when there is none."""
    found = _ANSWER.findall(text) or _WORD.findall(text)
    return ACTIONS.index(found[-1].lower()) if found else None


class FrozenLake:
    """One walk on one lake (see the module docstring).

    Args:
        size: the lake's side (cells).
        frozen: the share of frozen (safe) cells of a random map.
        slippery: gymnasium's slippery ice (a move may slide sideways).
    """

    tools = ()

    def __init__(self, size: int = 4, frozen: float = 0.8, slippery: bool = False) -> None:
        if size < 2 or not 0 < frozen <= 1:
            raise TypeError(f"size={size} must be at least 2 and frozen={frozen} in (0, 1]")
        self.size, self.frozen, self.slippery = size, frozen, slippery
        self.env = None
        self.position = 0
        self.reached = False

    def reset(self, task: Task) -> list[dict[str, str]]:
        """A fresh lake for ``task``, and the rules with its map."""
        import gymnasium
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        seed = int.from_bytes(hashlib.sha256(task.task_id.encode()).digest()[:4], "big")
        self.close()
        self.desc = generate_random_map(self.size, self.frozen, seed)
        self.env = gymnasium.make("FrozenLake-v1", desc=self.desc, is_slippery=self.slippery)
        self.position, _ = self.env.reset(seed=seed)
        self.reached = False
        rules = (
            "Walk on the frozen lake from where you stand (A) to the goal (G) without falling "
            "into a hole (H); F is safe ice. Answer each turn with one move: <answer>left"
            "</answer>, <answer>down</answer>, <answer>right</answer> or <answer>up</answer>."
        )
        return [{"role": "user", "content": f"{rules}\n{self.grid()}"}]

    def grid(self) -> str:
        """The map as text, one row a line, ``A`` where the walker stands."""
        rows = []
        for r, row in enumerate(self.desc):
            cells = ["A" if r * self.size + c == self.position else ch for c, ch in enumerate(row)]
            rows.append("".join(cells))
        return "\n".join(rows)

    def step(self, turn: AssistantTurn) -> StepResult:
        """Make the move and show the new map, or end the walk."""
        action = read_action(turn.content)
        info = {"moves": 1.0, "unreadable_moves": float(action is None)}
        if action is None:
            text = "I could not read a move. Answer with <answer>left</answer>, down, right or up."
            return StepResult([{"role": "user", "content": text}], info=info)
        assert self.env is not None  # reset() came first
        self.position, reward, terminated, truncated, _ = self.env.step(action)
        if terminated or truncated:
            self.reached = reward > 0
            return StepResult(reward=float(reward), done=True, info=info)
        return StepResult([{"role": "user", "content": self.grid()}], info=info)

    def expert_turn(self, answer_template: str) -> str:
        """A demonstration's next move: the first step of a shortest path to the goal that
        avoids the holes (breadth-first search on the map)."""
        goal = next(r * self.size + c for r, row in enumerate(self.desc) for c, ch in
                    enumerate(row) if ch == "G")  # fmt: skip
        first: dict[int, int | None] = {self.position: None}
        queue = deque([self.position])
        while queue:
            cell = queue.popleft()
            if cell == goal:
                break
            r, c = divmod(cell, self.size)
            for action, (dr, dc) in _MOVES.items():
                nr, nc = r + dr, c + dc
                if not (0 <= nr < self.size and 0 <= nc < self.size):
                    continue
                nxt = nr * self.size + nc
                if nxt in first or self.desc[nr][nc] == "H":
                    continue
                first[nxt] = action if first[cell] is None else first[cell]
                queue.append(nxt)
        action = first.get(goal)
        return answer_template.format(answer=ACTIONS[action or 0], reasoning="").strip()

    def reward(self) -> float:
        """1 when the walk reached the goal, else 0."""
        return 1.0 if self.reached else 0.0

    def close(self) -> None:
        """Close the gymnasium environment (idempotent)."""
        if self.env is not None:
            self.env.close()
            self.env = None
