"""``python -m services.api``: one API process (see services/api/server.py)."""
import sys

from services.api.server import main

sys.exit(main())
