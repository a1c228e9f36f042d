"""``python -m services.engine_core_service``: the engine-core process (service.py)."""
import sys

from services.engine_core_service.service import main

sys.exit(main())
