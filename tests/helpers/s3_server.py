"""A real S3-compatible server on 127.0.0.1 (moto's server mode) with IAM authentication enforced,
one user whose access key may do anything, and one bucket: used by the backup tests and benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from helpers.ports import free_port

# Requests moto serves before it starts checking signatures: exactly the three IAM calls below.
_UNAUTHENTICATED_SETUP_CALLS = 3
_ALLOW_ALL = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})


@dataclass
class S3Server:
    endpoint: str
    key: str
    secret: str
    bucket: str
    process: subprocess.Popen

    def env(self, **overrides: str) -> dict[str, str]:
        """Environment variables a client needs to use the server, as a user would set them."""
        env = {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
               "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
        env.update(overrides)
        return env

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_s3_server(bucket: str = "trainguard-test", timeout: float = 60) -> S3Server:
    import boto3

    port = free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_UNAUTHENTICATED_SETUP_CALLS))
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"moto server on port {port} did not start") from None
            time.sleep(0.2)
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                       aws_access_key_id="setup", aws_secret_access_key="setup")
    iam.create_user(UserName="trainguard")
    iam.put_user_policy(UserName="trainguard", PolicyName="all", PolicyDocument=_ALLOW_ALL)
    key = iam.create_access_key(UserName="trainguard")["AccessKey"]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
    s3.create_bucket(Bucket=bucket)
    return S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], bucket, process)
