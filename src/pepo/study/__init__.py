"""Study tools on top of the recipe: the paper's diagnostics of rollout dumps (``analysis``:
``python -m pepo.study.analysis``), the token intervention (``intervention``) and the
strategy comparison (``compare``: ``python -m pepo.study.compare``), its paired statistics
(``power``) and a second scoring of the validations' responses (``rescore``).

They need the recipe stack: ``pip install "pepo[recipe]"``.
"""

from pepo import _extras

_extras.require("pepo.study")
