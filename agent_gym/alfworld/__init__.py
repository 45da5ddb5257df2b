"""ALFWorld for agent_gym: game data, the engine with snapshots, and a game generator.

``games`` finds and reads games (real ALFWorld data or the bundled synthetic set) and
needs nothing beyond the standard library; ``engine`` runs one game on textworld's PDDL
backend; ``generate`` writes new verified games. The last two need the ``alfworld`` and
``textworld`` packages (installed by ``make setup``).
"""

from agent_gym.alfworld.games import SPLITS, TASK_TYPES, Game, GameError, GameRef

__all__ = ["SPLITS", "TASK_TYPES", "Game", "GameError", "GameRef"]
