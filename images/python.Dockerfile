# A Python sandbox image (scripts/build-python-image.sh NAME): the sandbox base, Debian's
# Python 3.11, and in /opt/venv the packages images/NAME/requirements.lock pins; the
# programs in images/NAME/bin go to /usr/local/bin.
FROM gpushare/sandbox-base:1 AS python
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/*

# The wheels come from the build context, downloaded on the host (its proxy and CA settings),
# checked against the lock's hashes here, in a stage of their own: the image keeps the
# installed packages, not the wheels too.
FROM python AS packages
COPY requirements.lock /tmp/requirements.lock
COPY wheels /tmp/wheels
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels \
        --require-hashes -r /tmp/requirements.lock

FROM python
COPY --from=packages /opt/venv /opt/venv
COPY bin/ /usr/local/bin/
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
