from memory_pipelines.resources.backups import BackupResource
from memory_pipelines.resources.derived import AnalyticsResource, ChromaResource, SummarizerResource
from memory_pipelines.resources.memory_store import MemoryStoreResource

__all__ = ["AnalyticsResource", "BackupResource", "ChromaResource", "MemoryStoreResource", "SummarizerResource"]
