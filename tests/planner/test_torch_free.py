import subprocess
import sys


def test_planner_and_plan_cli_do_not_import_torch():
    code = (
        "import sys\n"
        "import hybridkv.planner, hybridkv.cli.plan\n"
        "hybridkv.planner.plan_model('llama4-scout', memory='80GiB', max_model_len='1M')\n"
        "hybridkv.planner.render_plan(hybridkv.planner.plan_model('qwen3-next-80b-a3b', memory='80GiB'))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
