"""``python -m services.worker_service``: the worker process (service.py)."""
import sys

from services.worker_service.service import main

sys.exit(main())
