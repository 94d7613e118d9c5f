"""``python -m rlplug ...`` (used with torchrun: ``torchrun --nproc_per_node=2 -m rlplug train ...``)."""

import sys

from rlplug.cli import main

sys.exit(main())
