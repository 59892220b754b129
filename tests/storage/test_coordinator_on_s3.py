"""A coordinator whose ``blob_url`` names a bucket keeps every blob there, and reads them back."""

import hashlib

from gpuflex.client import Client
from gpuflex.coordinator.app import create_app
from gpuflex.coordinator.migrate import upgrade
from gpuflex.coordinator.settings import CoordinatorSettings
from gpuflex.protocol.spec import JobSpec
from gpuflex.testing import serve

from .conftest import s3_options


def test_uploads_land_in_the_bucket_and_jobs_find_them_there(tmp_path, s3_bucket, s3_endpoint):
    import s3fs

    settings = CoordinatorSettings(
        data_dir=tmp_path, blob_url=s3_bucket, blob_storage_options=s3_options(s3_endpoint)
    )
    upgrade(settings.sqlalchemy_url)
    corpus = b"text to train on " * 100
    digest = hashlib.sha256(corpus).hexdigest()
    with serve(create_app(settings)) as url:
        alice = Client(url, Client(url).create_account("alice").token)
        alice.deposit(5)
        assert alice.upload(corpus) == digest
        spec = JobSpec.model_validate({"name": "t", "budget": 1.0, "max_price_per_hour": 0.5})
        assert alice.submit(spec, dataset=digest).state == "pending"  # the coordinator found it in S3
    bucket = s3fs.S3FileSystem(**s3_options(s3_endpoint), skip_instance_cache=True)
    assert bucket.cat_file(f"{s3_bucket}/{digest[:2]}/{digest}") == corpus
    assert not (tmp_path / "blobs").exists()  # nothing went to the local directory
