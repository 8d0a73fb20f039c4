"""Study tools on top of the recipe: the paper's diagnostics of rollout dumps (``analysis``:
``python -m pepo.study.analysis``), the token intervention (``intervention``) and the
strategy comparison (``compare``: ``python -m pepo.study.compare``), its paired statistics
(``power``), a second scoring of the validations' responses (``rescore``) and a published
study put back under a study directory to go on elsewhere (``restore``).

They need the recipe stack: ``pip install -e ".[recipe]"``.
"""

from pepo import _extras

_extras.require("pepo.study")
