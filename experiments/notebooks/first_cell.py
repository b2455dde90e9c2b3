# Setup: run it again after Colab restarts the runtime (it is safe to rerun). In Colab it clones the
# repository once (REPO_URL: this project's, or your fork), installs it once with the jax build that
# matches the runtime (`[train,cuda]` on a GPU, `[train,tpu]` on a TPU) and checks the backend it got;
# from a checkout it only finds the notebooks' folder.
import glob
import os
import shutil
import subprocess
import sys

REPO_URL = os.environ.get("COPC_REPO_URL", "https://github.com/copc-jax/copc_jax.git")
REPO_DIR = os.environ.get("COPC_REPO_DIR", "/content/copc_jax")

if "google.colab" in sys.modules:
  if not os.path.exists(os.path.join(REPO_DIR, "pyproject.toml")):
    subprocess.run(["git", "clone", "--depth=1", REPO_URL, REPO_DIR], check=True)
  marker = os.path.join(REPO_DIR, ".colab_installed")
  if not os.path.exists(marker):
    runtime = ("tpu" if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
               else "cuda" if shutil.which("nvidia-smi") else "cpu")
    extras = "train" if runtime == "cpu" else f"train,{runtime}"
    for command in ("apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2",
                    f"pip install -q -e '.[{extras}]'", "pip install -q --no-deps google-jetstream==0.2.2"):
      print("+", command, flush=True)
      subprocess.run(command, shell=True, check=True, cwd=REPO_DIR)    # a failure stops here, shown
    with open(marker, "w") as f:
      f.write({"cpu": "cpu", "cuda": "gpu", "tpu": "tpu"}[runtime])
  notebooks = os.path.join(REPO_DIR, "experiments", "notebooks")
else:
  here = os.path.abspath(".")
  notebooks = here if os.path.exists(os.path.join(here, "notebook_lib.py")) else os.path.join(
      here, "experiments", "notebooks")
os.chdir(notebooks)
if notebooks not in sys.path:
  sys.path.insert(0, notebooks)
import notebook_lib as nb  # noqa: E402  (puts the repository on sys.path; nb.SMOKE shrinks live runs (CI))

if "google.colab" in sys.modules:
  with open(os.path.join(REPO_DIR, ".colab_installed")) as f:
    expected = f.read().strip()
  got = nb.accelerator()
  assert got == expected, (f"the runtime has a {expected} but JAX runs on {got}: restart the session "
                           f"(Runtime > Restart session) and run this cell again")
print("smoke setting" if nb.SMOKE else "full setting", "| JAX backend:", nb.accelerator())
