"""``python -m cpkv ...`` is the ``cpkv`` command."""

import sys

from .tools.cli import main

sys.exit(main())
