"""Tools over the engine and the runtime: the ``cpkv`` command, benchmarks, the simulator."""
