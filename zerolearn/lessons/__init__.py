"""The chapters' lessons by their former name: they are in :mod:`zerolearn.chapters`, one
``chNN/lesson.py`` per chapter."""
