"""Celery workflows that decide and drive: deploy, canary, drills, tidal schedules."""
