"""An untrusted file that names a global makes ``safe_torch_load`` import nothing but the allow-list's
own modules: importing a module runs its code, and torch holds modules that do a lot on import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PLANTED_MODULE = "torch._dynamo"

# Runs in a fresh interpreter, where the planted module is not imported yet. The file is written with
# a stand-in for the module in sys.modules (pickle checks that the class it names can be found),
# removed again before the load.
CHILD = textwrap.dedent(f"""
    import sys, types
    import torch
    from trainguard.checkpoint.safe_load import safe_torch_load

    module = "{PLANTED_MODULE}"
    assert module not in sys.modules, "imported before the load: pick a module torch does not import"
    stand_in = types.ModuleType(module)

    class Planted:
        pass

    Planted.__module__, Planted.__qualname__ = module, "Planted"
    stand_in.Planted = Planted
    sys.modules[module] = stand_in
    path = sys.argv[1]
    torch.save({{"weight": torch.ones(2), "planted": Planted()}}, path)
    del sys.modules[module]

    try:
        safe_torch_load(path)
    except Exception as refused:
        print(f"{{type(refused).__name__}}: {{refused}}")
    print("imported:", module in sys.modules)
""")


def test_a_file_naming_a_global_of_a_module_outside_the_allow_list_is_refused_without_importing_it(tmp_path):
    path = tmp_path / "model_world_size_1_rank_0.pt"
    child = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert lines == [f"UnsafeCheckpointError: refusing to load {path}: it contains pickled code/objects that "
                     f"weights_only loading does not allow ({PLANTED_MODULE}.Planted)", "imported: False"]
