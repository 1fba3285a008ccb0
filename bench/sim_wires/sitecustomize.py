# Makes simwires' modes exist in every process started with PYTHONPATH=bench/sim_wires (the bench's ranks too).
import importlib

importlib.import_module("simwires")
