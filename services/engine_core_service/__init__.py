"""The engine-core process: EngineCore's step loop between the API processes and the
worker (``python -m services.engine_core_service``). See service.py."""
