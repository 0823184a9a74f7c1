"""`python -m lora_router`: the same command as `lora-router`."""

import sys

from lora_router.cli import main

sys.exit(main())
