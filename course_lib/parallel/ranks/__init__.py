"""Starting ranks: ``run_ranks`` for notebooks and tests, ``init_distributed`` under torchrun.

| module | job |
| --- | --- |
| ``launch`` | ``run_ranks`` (fork-server ranks, results over pipes, the first failure kills all), ``init_distributed``, ``teardown`` |
| ``entry`` | what a started rank runs first (threads, output, process group) before the user's function |
| ``elastic_store`` | one store key space per torchrun restart attempt |
"""
