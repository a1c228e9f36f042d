"""``python -m services.worker_service``: the worker process (service.py)."""
import sys

from services.worker_service.omp_spin import apply_from_argv

apply_from_argv(sys.argv[1:])  # before torch loads libgomp, which reads it once

from services.worker_service.service import main  # noqa: E402

sys.exit(main())
