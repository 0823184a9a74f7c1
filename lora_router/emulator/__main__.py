"""`python -m lora_router.emulator`: the same as the `lora-router-emulator` command."""

import sys

from lora_router.emulator.cli import main

sys.exit(main())
