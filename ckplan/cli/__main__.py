"""``python -m ckplan.cli``: the ``ckplan`` command, as ``python -m ckplan`` runs it."""
from . import main

if __name__ == "__main__":
    main()
