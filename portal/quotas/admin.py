from django.contrib import admin

from portal.quotas.models import QuotaPolicy

admin.site.register(QuotaPolicy)
