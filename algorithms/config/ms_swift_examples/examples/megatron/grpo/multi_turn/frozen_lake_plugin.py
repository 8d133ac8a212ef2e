"""A text FrozenLake for multi-turn GRPO, in the form of ms-swift's frozen-lake plugin
(examples/megatron/grpo/multi_turn/frozen_lake_plugin.py there): each turn the model sees the
grid (S start, G goal, H hole, F ice, P itself) and answers one move in <action>...</action>;
reaching G gives reward 1 and ends the episode, a hole ends it with 0. A row's `env_config`
column (`seed`, `size`, `p`) fixes its map, so the num_generations trajectories of a row play
the same map. The plugin's only change for this project is its import line.
"""
from __future__ import annotations

import random
import re
from typing import Any, Dict, List, Optional, Tuple

from algorithms.plugins import Env, envs

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
TAGGED = re.compile(r"<action>\s*(up|down|left|right)\s*</action>", re.IGNORECASE)
BARE = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)
RULES = ("FrozenLake: P is you, S the start, G the goal, H a hole, F ice. Move one cell per turn; "
         "reach G (+1), a hole ends the game. Answer <action>up|down|left|right</action>.")


def reachable(grid: List[str]) -> bool:
    """Whether G can be reached from S without crossing a hole (depth-first search)."""
    size = len(grid)
    start = next((r, row.index("S")) for r, row in enumerate(grid) if "S" in row)
    todo, seen = [start], set()
    while todo:
        r, c = todo.pop()
        if (r, c) in seen or not (0 <= r < size and 0 <= c < size) or grid[r][c] == "H":
            continue
        if grid[r][c] == "G":
            return True
        seen.add((r, c))
        todo += [(r + dr, c + dc) for dr, dc in MOVES.values()]
    return False


def make_map(size: int, p: float, seed: Optional[int]) -> List[str]:
    """A solvable size x size map with random start and goal, the same for the same seed."""
    rng = random.Random(seed)
    while True:
        cells = [["F" if rng.random() < p else "H" for _ in range(size)] for _ in range(size)]
        (sr, sc), (gr, gc) = [divmod(i, size) for i in rng.sample(range(size * size), 2)]
        cells[sr][sc], cells[gr][gc] = "S", "G"
        grid = ["".join(row) for row in cells]
        if reachable(grid):
            return grid


def draw(grid: List[str], row: int, col: int) -> str:
    lines = [list(line) for line in grid]
    lines[row][col] = "*" if lines[row][col] == "G" else "P"
    return "\n".join(" ".join(line) for line in lines)


def parse_move(text: str) -> Optional[str]:
    tagged = TAGGED.search(text)
    if tagged:
        return tagged.group(1).lower()
    bare = BARE.findall(text)
    return bare[-1].lower() if bare else None


class FrozenLakeEnv(Env):

    def __init__(self, env_config: Dict[str, Any]):
        super().__init__(env_config)
        self.size, self.p = int(env_config.get("size", 4)), float(env_config.get("p", 0.8))
        self.seed = None if env_config.get("seed") is None else int(env_config["seed"])
        self.grid: List[str] = []
        self.row = self.col = self.moves = 0

    async def reset(self, config: Any) -> Tuple[str, Dict[str, Any], str]:
        self.grid = make_map(self.size, self.p, self.seed)
        self.row, self.col = next((r, line.index("S")) for r, line in enumerate(self.grid) if "S" in line)
        self.moves = 0
        return f"{draw(self.grid, self.row, self.col)}\nYour first move?", {"seed": self.seed}, RULES

    async def step(self, action: List[Dict[str, str]]) -> Tuple[str, float, bool, Dict[str, Any]]:
        move = parse_move(action[-1].get("content", "") if action else "")
        self.moves += 1
        if move is None:
            return f"No move found.\n{draw(self.grid, self.row, self.col)}", 0.0, False, {"status": "invalid"}
        dr, dc = MOVES[move]
        self.row = min(max(self.row + dr, 0), self.size - 1)
        self.col = min(max(self.col + dc, 0), self.size - 1)
        cell = self.grid[self.row][self.col]
        board = draw(self.grid, self.row, self.col)
        if cell == "G":
            return f"Goal!\n{board}", 1.0, True, {"status": "goal"}
        if cell == "H":
            return f"Hole.\n{board}", 0.0, True, {"status": "hole"}
        return f"{board}\nNext move?", 0.0, False, {"status": "ok"}

    async def close(self) -> None:
        pass


envs["frozen_lake"] = FrozenLakeEnv
