"""Engram table storage: one interface (:class:`~engram_trt.tables.store.TableStore`)
over every place the tables can live.

Tables are the one part of an Engram model that does not fit an engine or, for real
models, a GPU (about 200 GB for a DeepSeek-V4.1-Flash-sized model), so the runtime
chooses where they live and the rest of the stack sees only per-layer row and scale
tensors plus what kind of memory holds them:

| kind | module | where | chosen by (``--engram-config``) |
| --- | --- | --- | --- |
| ``memory`` | :mod:`.store` | ordinary host memory (the CPU reference) | no GPU |
| ``device`` | :mod:`.store` | GPU memory | ``cpu_offload: false`` |
| ``pinned`` | :mod:`.pinned` | host memory registered for UVA, in chunks | default with a GPU |
| ``shared`` | :mod:`.shared` | one ``/dev/shm`` segment per node, every process attaches | ``dp_shared_memory`` |
| ``file`` | :mod:`.store` | the checkpoint files through the page cache | ``host_file_gather`` |

:func:`open_tables` is the one factory; :mod:`.source` says where each table's bytes
are on disk (from a checkpoint or an engine folder's manifest) and checks them.
"""

from engram_trt.tables.source import TableRef, check_table_files, layer_refs  # noqa: F401
from engram_trt.tables.store import TABLE_KINDS, TableStore, open_tables, table_kind_for  # noqa: F401
