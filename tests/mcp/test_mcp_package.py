"""`art.mcp`'s names load on first use: a server module in the package starts without the agent loop's imports,
and the functions named like their modules stay functions whichever is imported first."""

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_the_notes_server_module_imports_neither_pandas_nor_the_openai_sdk():
    out = _run("import sys, artnb.mcp.notes_server; print(sorted({'pandas', 'openai'} & set(sys.modules)))")
    assert out.strip() == "[]"  # each rollout starts one: these were 2.1 s of its 3 s of imports


def test_evaluate_and_generate_scenarios_stay_functions_after_their_modules_are_imported():
    out = _run(
        "import artnb.mcp.evaluate, artnb.mcp.generate_scenarios\n"
        "from artnb.mcp.generate_scenarios import hosted_generator\n"
        "import artnb as art\n"
        "from artnb.mcp import GeneratedScenario\n"
        "print(callable(art.mcp.evaluate), callable(art.mcp.generate_scenarios), art.mcp.GeneratedScenario is "
        "GeneratedScenario, sorted(set(art.mcp.__all__) - set(dir(art.mcp))))"
    )
    assert out.strip() == "True True True []"


def test_submodules_are_attributes_as_before():
    out = _run("import artnb as art; print(bool(art.mcp.agent.SYSTEM), art.mcp.types.MCPTool.__name__)")
    assert out.strip() == "True MCPTool"  # the MCP tutorial's rollout reads art.mcp.agent.SYSTEM
    missing = subprocess.run(
        [sys.executable, "-c", "import artnb as art; art.mcp.no_such_name"], capture_output=True, text=True
    )
    assert "module 'artnb.mcp' has no attribute 'no_such_name'" in missing.stderr
