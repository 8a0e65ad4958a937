from memory_pipelines.resources.memory_store import MemoryStoreResource

__all__ = ["MemoryStoreResource"]
