"""The supervised kinds' job routes (the seed server's paths), each built by api/routes/job_routes.py."""

from api.routes.job_routes import job_router
from shared.train_specs import DPOJobCreate, ORPOJobCreate, RewardJobCreate, SFTJobCreate

ROUTERS = [
    job_router("sft", "/admin/api/fine-tune/jobs", "SFT jobs", SFTJobCreate, "an SFT job"),
    job_router("dpo", "/admin/api/fine-tune/dpo/jobs", "DPO jobs", DPOJobCreate, "a DPO job"),
    job_router("orpo", "/admin/api/fine-tune/orpo/jobs", "ORPO jobs", ORPOJobCreate, "an ORPO job"),
    job_router("reward", "/admin/api/fine-tune/reward/jobs", "Reward-model jobs", RewardJobCreate, "a reward-model job"),
]
