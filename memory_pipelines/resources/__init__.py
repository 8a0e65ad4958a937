from memory_pipelines.resources.backups import BackupResource
from memory_pipelines.resources.derived import AnalyticsResource, ChromaResource, SummarizerResource, derived_stores
from memory_pipelines.resources.judge import JudgeResource
from memory_pipelines.resources.memory_store import MemoryStoreResource
from memory_pipelines.resources.notifier import NotifierResource

__all__ = [
    "AnalyticsResource",
    "BackupResource",
    "ChromaResource",
    "JudgeResource",
    "MemoryStoreResource",
    "NotifierResource",
    "SummarizerResource",
    "derived_stores",
]
