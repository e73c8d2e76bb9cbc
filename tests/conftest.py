import os
import sys

# Spawned ranks import test jobs by module name ("jobs"), so this folder must be on
# sys.path before they start; spawn copies the parent's sys.path.
sys.path.insert(0, os.path.dirname(__file__))
