"""A module beside beside/model.py, imported by it as a script imports its neighbours."""
HIDDEN = 16
