"""The worker process: a ModelRunner behind a WebSocket
(``python -m services.worker_service``). See service.py."""
