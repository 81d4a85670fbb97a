from worker_svc.attention.base import AttentionBackend

__all__ = ["AttentionBackend"]
