"""Driver: runs a job on a Ray cluster. Ray Train config from a spec (driver.ray_config), the run's entry and
summary (driver.fitting), the executor of the placement loop's decisions (driver.placements), capacity polling
on Ray (driver.capacity), the run folder and summary (driver.runs) job submission to a cluster
(driver.submit) and Ray token refusals as one line naming the fix (driver.auth)."""
